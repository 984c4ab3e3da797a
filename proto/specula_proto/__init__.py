"""What Specula's processes share: the gRPC stubs generated from proto/generate.proto (package specula.v1;
regenerate with `make proto`), and the named choices of settings and requests (choices.py)."""
