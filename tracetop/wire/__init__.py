"""The wire: protobuf contract (package tracetop.v1), columnar codec, and the shipper every
producer uses. Never imports duckdb, textual, or any other package of the project."""
