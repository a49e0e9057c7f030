"""Command-line interface: parses arguments and calls packer/runtime/format_spec."""
