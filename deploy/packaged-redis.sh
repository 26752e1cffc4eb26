# Sourced by deploy/run-local and tests/run after they install Debian's redis-server,
# with `as_root` defined. The package starts and enables a Redis service of its own on
# 127.0.0.1:6379 (saving to disk, restarted by systemd): the tests start their own
# Redis processes, and deploy/run-local a throwaway one without persistence (stopped
# with `shutdown nosave`), so the packaged service is stopped and disabled.
disable_packaged_redis() {
    if [ -d /run/systemd/system ] && systemctl is-enabled --quiet redis-server 2>/dev/null; then
        echo "==> disabling the redis-server service the package started (systemctl disable --now)"
        as_root systemctl disable --now redis-server
    elif [ ! -d /run/systemd/system ] && command -v service >/dev/null; then
        # An init script the package ran (no systemd): stopped, if it started one.
        as_root service redis-server stop >/dev/null 2>&1 || true
    fi
}
