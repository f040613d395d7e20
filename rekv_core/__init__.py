"""rekv_core: the model executor, quantizer kernels, codecs, handoff schedule, transports and planner
of the ReKV prefill-to-decode KV handoff. It never imports the services, gRPC or generated protobuf
modules, so it can be embedded in another serving engine and tested without a server."""
