"""The wire, shared by both sides: message kinds and framing, and the liveness rules
(`protocol`), the sharding plan and its hash (`plan`), a snapshot read in pieces
(`snapshot`).
Imports nothing of the other wings."""
