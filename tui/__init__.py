"""The `tracetop` terminal UI (Textual). Talks to a collector over the wire or opens a file."""
