"""Environment service (`sparkrl env`): episodes' environments held between a worker's calls, over HTTP."""
