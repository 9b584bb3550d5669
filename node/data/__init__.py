"""What a node trains on: corpora, tokenizers, ``atoll data prepare`` and what a run binds."""
