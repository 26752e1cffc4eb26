# Sourced by deploy/run-local, tests/run and tests/bench/run: `require_redis_6_2`, and,
# after they install Debian's packages, `disable_packaged_service` (with `as_root`
# defined). Debian's redis-server starts and enables a Redis service of its own on
# 127.0.0.1:6379 (saving to disk, restarted by systemd), and etcd-server an etcd on
# 2379: the tests start their own Redis processes, deploy/run-local a throwaway one
# without persistence (stopped with `shutdown nosave`), and the bench its own Redis
# and etcd, so the packaged services are stopped and disabled. `$1` is the service.
disable_packaged_service() {
    if [ -d /run/systemd/system ] && systemctl is-enabled --quiet "$1" 2>/dev/null; then
        echo "==> disabling the $1 service the package started (systemctl disable --now)"
        as_root systemctl disable --now "$1"
    elif [ ! -d /run/systemd/system ] && command -v service >/dev/null; then
        # An init script the package ran (no systemd): stopped, if it started one.
        as_root service "$1" stop >/dev/null 2>&1 || true
    fi
}

# latchkey needs Redis 6.2 (GETDEL); older distributions package 6.0, which the server
# refuses at start: said now, before a build of minutes. `$1` is the version.
require_redis_6_2() {
    if [ -n "$1" ] && ! printf '6.2\n%s\n' "$1" | sort -V -C; then
        echo "$0: Redis $1 is older than 6.2, which latchkey needs; install a newer Redis (README, Quick start)" >&2
        exit 1
    fi
}
