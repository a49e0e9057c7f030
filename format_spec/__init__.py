"""The moepack container format: the written spec (SPEC.md) and the only code that knows its byte layout."""
