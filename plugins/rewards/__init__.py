"""Built-in reward backends, one module per way of scoring. Each receives decoded text, so any tokenizer works.

- ``function``: ``callable``, any Python function ``module:function(prompts, responses, **kwargs)``;
  ``toy`` holds small exact functions for it (``char_count``, ``exclamation_count``, ``constant``).
- ``classifier``: learned reward models, ``hf_classifier`` (a local sequence classifier) and ``ensemble``.
- ``text``: what the text means, ``sentiment`` (VADER) and the MiniLM embedding rewards
  (``embedding_similarity``, ``prompt_relevance``, ``sentiment_relevance``).
- ``verifiable``: ``exact_answer``, checked against the answer of the prompt's arithmetic question.
- ``remote``: ``remote``, scores from an HTTP server.
"""

from rlhf_lightning_plugins.rewards import classifier, function, remote, text, toy, verifiable  # noqa: F401
