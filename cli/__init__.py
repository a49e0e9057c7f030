"""Command-line interface: parses arguments and calls serve/tools/packer/runtime/format_spec."""
