"""Tool environments: the plug-in framework, the calculator and python environments, the call format, the sandbox."""
