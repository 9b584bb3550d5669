"""The Atoll node: the daemon, the operator's commands and everything they run.

Atoll never reaches a model or dataset hub: models, tokenizers and corpora come from
local paths. Offline mode is set here, before any Hugging Face library is imported
(they read it once, at import), and every load also passes ``local_files_only``.
"""

import os as _os

for _name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE"):
    _os.environ[_name] = "1"
_os.environ["HF_HUB_DISABLE_TELEMETRY"] = "1"
_os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
