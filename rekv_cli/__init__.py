"""The `rekv` command: what a person types. It starts and drives the services (`rekv serve`,
`rekv demo`, `rekv bench link`), measures and gates (`rekv profile`, `rekv gate`, `rekv bench
handoff`) and asks the planner (`rekv plan`). Nothing here runs inside a service's pod except the
`rekv serve` entry point, which hands over to `services.prefill` or `services.decode`, and `rekv
health`, the container's health check."""
