"""`python -m sparkrl.cli`: what the launcher, torchrun and the deploy files start."""

from sparkrl.cli import app

app()
