"""The scripts inside the ramdisk: ``/init`` (PID 1) and udhcpc's ``default.script``.

Kept apart from the builder so the text the cache key hashes is plain to read, and so another
image (the test OS) can reuse the same start-up pieces with an init of its own.
"""

from __future__ import annotations

from typing import Final

__all__ = ["INIT", "NET_UP", "UDHCPC_SCRIPT"]

MOUNTS: Final = r"""mount -t proc proc /proc
mount -t sysfs sysfs /sys
mount -t devtmpfs devtmpfs /dev 2>/dev/null
mkdir -p /dev/pts /dev/shm
mount -t devpts devpts /dev/pts
mount -t tmpfs -o mode=1777 tmpfs /dev/shm
mount -t tmpfs -o mode=0755 tmpfs /run
exec </dev/console >/dev/console 2>&1
"""
"""What a PID 1 mounts first (proc, sys, devtmpfs, pts, shm, run) and its console; the ramdisk's
init and the test OS image's (runtime.os_image_init) both start so."""

COLDPLUG: Final = r"""for pass in 1 2; do
    for alias in $(cat /sys/bus/*/devices/*/modalias 2>/dev/null | sort -u); do
        modprobe -q "$alias" 2>/dev/null
    done
done
for module in $(cat /etc/bc-ramdisk/modules); do
    modprobe -q "$module" 2>/dev/null
done
"""
"""Drivers for the devices the machine has, by their modalias (what udev does at coldplug); twice,
for the devices the first drivers bring; then the listed modules (file systems). Both inits."""

NET_UP: Final = r"""#!/bin/sh
# Bring up every NIC backed by a device with DHCP (busybox udhcpc); returns once each NIC has a
# lease or gave up for now (udhcpc keeps trying in the background).
ip link set lo up
for dev in /sys/class/net/*; do
    nic=${dev##*/}
    [ -e "$dev/device" ] || continue
    ip link set "$nic" up
    udhcpc -i "$nic" -s /etc/udhcpc/default.script -b -t 10 -T 2 -A 5 -x hostname:bc-ramdisk \
        -p "/run/udhcpc.$nic.pid" >/dev/console 2>&1 &
done
wait
"""

UDHCPC_SCRIPT: Final = r"""#!/bin/sh
# busybox udhcpc's hook: address, default route (one per NIC, ordered by ifindex), DNS.
[ -n "$interface" ] || exit 1
metric=$(cat "/sys/class/net/$interface/ifindex" 2>/dev/null || echo 100)
case "$1" in
    deconfig)
        ip -4 addr flush dev "$interface"
        ip link set "$interface" up
        rm -f "/run/resolv.$interface"
        ;;
    bound|renew)
        ip -4 addr flush dev "$interface"
        ip -4 addr add "$ip/${mask:-24}" ${broadcast:+broadcast "$broadcast"} dev "$interface"
        if [ -n "$router" ]; then
            set -- $router
            ip route replace default via "$1" dev "$interface" metric "$metric"
        fi
        : > "/run/resolv.$interface"
        [ -n "$domain" ] && echo "search $domain" >> "/run/resolv.$interface"
        for server in $dns; do echo "nameserver $server" >> "/run/resolv.$interface"; done
        echo "bc-ramdisk: $interface $ip/${mask:-24} via ${router:-none}" > /dev/console
        ;;
esac
cat /run/resolv.* > /etc/resolv.conf 2>/dev/null
exit 0
"""

INIT: Final = (
    r"""#!/bin/sh
# bc-ramdisk /init (PID 1): mount, load drivers, DHCP on every NIC, then bcd (join, then run, in
# one process), started again whenever it exits (systemd's Restart=always). All on the console.
export PATH=/usr/sbin:/usr/bin:/sbin:/bin
mkdir -p /proc /sys /dev /run /tmp /var/lib/bcd /etc/bcd
"""
    + MOUNTS
    + r"""say() { echo "bc-ramdisk [$(cut -d' ' -f1 /proc/uptime)s]: $*"; }
say "$(cat /etc/bc-ramdisk/release) on $(uname -r)"
# drivers for the devices this machine has, by their modalias (what udev does at coldplug);
# twice, for the devices the first drivers bring (disks behind a controller, USB devices)
"""
    + COLDPLUG
    + r"""say "$(wc -l < /proc/modules) modules loaded"
hostname bc-ramdisk
sh /etc/bc-ramdisk/net-up
touch /etc/bcd/ramdisk
if [ -x /etc/bc-ramdisk/local ]; then /etc/bc-ramdisk/local; fi
delay=1
while true; do
    # joins first (bcd.token= of the kernel line) unless /var/lib/bcd holds an enrollment
    say "bcd run --join"
    bcd run --join
    code=$?
    if [ -f /var/lib/bcd/enrollment.json ]; then
        delay=1
        say "bcd exited ($code); restarting"
    else
        say "bcd did not join ($code); again in ${delay}s"
        sleep "$((delay - 1))"
        [ "$delay" -lt 30 ] && delay=$((delay * 2))
    fi
    sleep 1
done
"""
)
