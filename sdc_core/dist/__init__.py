"""Between ranks and processes: ranks, hosts and ring partners, the collectives and the point-to-point
exchange (``topology``), the peer-payload codec (``payload``) and the shapes a received payload must
have (``payload_checks``). Imports only the package's leaves."""
