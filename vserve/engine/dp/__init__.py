"""Data parallel: N engine cores behind one front end. `client.py` (the front end's client over
N engines and its death rules), `router.py` (least loaded), `remote.py` (engines on other hosts,
reached over TCP), `transport.py` (what crosses hosts and whom it trusts), `headless.py` (a
host that runs engines for a head elsewhere)."""
