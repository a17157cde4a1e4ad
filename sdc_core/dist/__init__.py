"""Between ranks and processes: ranks, hosts and ring partners, the collectives and the point-to-point
exchange (``topology``), the peer-payload codec (``payload``), and process exit (``shutdown``,
``exit_order``). Imports only the package's leaves."""
