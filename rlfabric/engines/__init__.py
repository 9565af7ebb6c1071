"""Generation engines behind one contract (``rlfabric.engines.base``): a torch engine and vLLM."""
