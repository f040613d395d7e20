"""`rekv bench link`: the two services across an emulated cross-node link (`sweep`), the router
process that drives them (`client`), the namespaces and the shaped veth pair (`netns`)."""
