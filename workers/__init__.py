"""The device side: worker processes, the model runner, the persistent input batch, sampling."""
