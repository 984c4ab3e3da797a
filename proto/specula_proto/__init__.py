"""What Specula's processes share: the gRPC stubs generated from proto/generate.proto (package specula.v1;
regenerate with `make proto`), the named choices of settings and requests (choices.py), the table of settings
the launcher's, the router's and the worker's command lines are built from (setting.py, settings.py), and the
token limits' defaults the launcher and the router both derive (limits.py)."""
