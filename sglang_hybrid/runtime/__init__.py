"""In-server capture of checkpoints at anchor positions inside a prefill forward."""
