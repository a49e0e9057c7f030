"""OpenAI's `tools` field checked, family-neutral: the chat encodings' tool formats (families/deepseek_v4/tools.py)
and the server's chat-template tool calls (serve/tool_calls.py) take the same shape."""

from __future__ import annotations

from moepack.format_spec.errors import MoepackError


def check_tools(tools, where: str) -> list[dict]:
    """OpenAI's `tools`: [{"type": "function", "function": {"name": ...}}]; MoepackError naming the bad one."""
    if not isinstance(tools, list) or not tools:
        raise MoepackError(f"{where}: expected a non-empty list of tools")
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type", "function") != "function" or not isinstance(fn, dict) \
                or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise MoepackError(f'{where}[{i}]: expected {{"type": "function", "function": {{"name": ...}}}}')
    return tools
