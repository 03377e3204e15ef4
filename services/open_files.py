"""The open-file limit: a process holding thousands of sockets (the gateway's streams, a load generator's
clients) raises its soft RLIMIT_NOFILE to the hard limit, which needs no privilege. Many systems start
processes at a soft limit of 1,024, a few hundred streams short of what a burst opens."""

from __future__ import annotations


def raise_open_file_limit() -> int:
    """Raise the soft limit to the hard one (where the platform has one); returns the limit now in force."""
    try:
        import resource
    except ImportError:  # not POSIX
        return -1
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY:
        hard = max(soft, 1 << 20)  # an unlimited hard limit still has a kernel ceiling (fs.nr_open)
    if soft != resource.RLIM_INFINITY and soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
            soft = hard
        except (ValueError, OSError):
            pass
    return soft
