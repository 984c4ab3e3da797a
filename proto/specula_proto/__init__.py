"""Generated gRPC stubs for proto/generate.proto (package specula.v1). Regenerate with `make proto`."""
