"""The ``extra_args`` keys a request carries from the parser wrapper (API-server process) to our
logits processor (engine process): ``vllm_xargs`` on the request, ``SamplingParams.extra_args`` in
the engine. Names only: the worker reads them without loading anything else."""

from __future__ import annotations

#: ``extra_args`` keys a constrained request carries: the structural tag JSON and its sha256
XARGS_TAG = "vllm_allowed_tools_tag"
XARGS_DIGEST = "vllm_allowed_tools_tag_digest"
#: optional, together: the same grammar split into the catalog's grammar and the subset's envelope
#: (``decode/split.py``), each JSON with its sha256
XARGS_CATALOG = "vllm_allowed_tools_catalog_tag"
XARGS_CATALOG_DIGEST = "vllm_allowed_tools_catalog_tag_digest"
XARGS_ENVELOPE = "vllm_allowed_tools_envelope_tag"
XARGS_ENVELOPE_DIGEST = "vllm_allowed_tools_envelope_tag_digest"
XARGS_SPLIT_KEYS = (XARGS_CATALOG, XARGS_CATALOG_DIGEST, XARGS_ENVELOPE, XARGS_ENVELOPE_DIGEST)
#: the keys of the grammar a request carries to the logits-processor stage
XARGS_GRAMMAR_KEYS = (XARGS_TAG, XARGS_DIGEST, *XARGS_SPLIT_KEYS)
#: ``extra_args`` key of a turn that must call: the tokens to keep for its shortest call
XARGS_MUST_CALL = "vllm_allowed_tools_must_call"
#: ``extra_args`` key of a turn whose parser reads some stop tokens as text: those token ids, which
#: the model may never write (on either constraint stage)
XARGS_REFUSED_TOKENS = "vllm_allowed_tools_refused_tokens"
#: ``extra_args`` key of a turn whose allowlist narrows its catalog: its free text may be held to
#: valid UTF-8 while its first-seen grammar compiles (llguidance's matcher:
#: ``decode/lazy_grammars.py``); a plain turn's text (held to its whole catalog, or to nothing)
#: stays what vanilla vLLM samples, so its rows wait for xgrammar's compile
XARGS_TEXT_UTF8 = "vllm_allowed_tools_text_utf8"
#: every ``extra_args`` key of ours: set by the parser wrapper only, never by a client
XARGS_KEYS = (*XARGS_GRAMMAR_KEYS, XARGS_MUST_CALL, XARGS_REFUSED_TOKENS, XARGS_TEXT_UTF8)
