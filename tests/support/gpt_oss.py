"""The tiny gpt-oss's marker nudges: ``logit_bias`` that makes the random-weight model write
harmony's markers as their one token, as a trained gpt-oss does. The gpt-oss tests and the
server-side tools tests (the same model behind ``--tool-server``) send them with every request."""

from __future__ import annotations

_NUDGES: dict[str, float] = {}


def nudges() -> dict:
    """Harmony's markers (<|start|>, <|end|>, <|message|>, <|channel|>, <|constrain|>, <|call|>)
    written as their one token, as a trained gpt-oss writes them (the grammar admits them only as
    their tokens anyway, and no string or free text may spell one). Nothing else is nudged."""
    if not _NUDGES:
        from vllm_allowed_tools.devtools.models.format_model import writing_nudges
        from vllm_allowed_tools.devtools.models.gpt_oss_model import ensure_gpt_oss_model
        markers = {"<|start|>": 30.0, "<|end|>": 30.0, "<|message|>": 30.0, "<|channel|>": 30.0,
                   "<|constrain|>": 30.0, "<|call|>": 40.0}
        _NUDGES.update(writing_nudges(ensure_gpt_oss_model(0, log=lambda *_: None), markers))
    return {"logit_bias": dict(_NUDGES)}
