"""The plugin's plain ASGI layer in the API server: the middleware's request path
(:mod:`.middleware`), the guarded ``send`` every answer leaves through (:mod:`.guarded_send`),
which of vLLM's routes are guarded (:mod:`.routes`) and vLLM's API-key check run first
(:mod:`.authentication`). It imports no vLLM; ``vllm_glue/`` builds it with the server's start-up
decisions."""
