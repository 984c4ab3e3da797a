# Developer tasks. `make proto` regenerates the gRPC stubs committed under proto/specula_proto/.
.PHONY: proto test

proto:
	python -m grpc_tools.protoc --proto_path=specula_proto=proto --python_out=proto --pyi_out=proto \
		--grpc_python_out=proto proto/generate.proto

test:
	python -m pytest
