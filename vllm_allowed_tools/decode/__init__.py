"""The decode path: the grammar each turn is held to, with no vLLM import.

A turn's whole grammar is decided in one call from the request the glue read once
(:mod:`.turn_grammar`). Its allowlist becomes a structural tag (:mod:`.grammar`), built by vLLM's
own builders where they exist (:mod:`.vllm_builder`) so the plugin's grammar is the one vLLM would
build; arguments are held to their schemas (:mod:`.argument_schemas`, :mod:`.safe_json`); the
logits-processor stage compiles and masks per row (:mod:`.compiled`, :mod:`.masks`, :mod:`.stage`).
The vLLM side of each piece lives in ``vllm_glue/``."""
