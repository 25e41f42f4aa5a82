"""The wire, shared by both sides: message kinds and framing (`protocol`), the
sharding plan and its hash (`plan`), and the liveness rules (`liveness`).
Imports nothing of the other wings."""
