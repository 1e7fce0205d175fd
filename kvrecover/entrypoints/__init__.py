"""Online serving: the OpenAI-compatible server (`kvrecover serve`) and the
prefill/decode proxy (`kvrecover proxy`)."""
