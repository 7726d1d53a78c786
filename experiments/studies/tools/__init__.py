"""The tool-use studies (docs/results/tools*/, code_tools*/): seeds of a tool job and what the model does with replies."""
