"""Prometheus metrics of a mount (``-o metrics=HOST:PORT``), read from the store at each scrape.

Why a collector, not counters updated on the data path: the store already keeps every figure
(`status()`), so a scrape costs one short hold of the namespace lock and the write path pays
nothing.  Names follow Prometheus conventions (``_bytes``, ``_total``, ``_seconds``).
"""
from __future__ import annotations

import logging

log = logging.getLogger("retainzfs")


def parse_listen(val: str) -> tuple[str, int]:
    """'9464' -> ('127.0.0.1', 9464); 'HOST:PORT' as given ('[::1]:9464' for IPv6)."""
    host, sep, port = val.rpartition(":")
    if not sep:
        host, port = "127.0.0.1", val
    host = host.strip("[]") or "127.0.0.1"
    p = int(port)
    if not 0 < p < 65536:
        raise ValueError
    return host, p


class StoreCollector:
    def __init__(self, store) -> None:
        self.store = store

    def collect(self):
        from prometheus_client.core import (CounterMetricFamily, GaugeMetricFamily,
                                            HistogramMetricFamily)
        st = self.store.status()
        zones = GaugeMetricFamily("retainzfs_zones", "Zones by condition", labels=["condition"])
        for cond, n in sorted(st["zones"].items()):
            zones.add_metric([cond], n)
        yield zones
        for name, key, doc in (
                ("retainzfs_live_bytes", "live_bytes", "Bytes of live file data in data zones"),
                ("retainzfs_invalid_bytes", "invalid_bytes", "Dead bytes in zones not yet reset"),
                ("retainzfs_tail_bytes", "tail_bytes", "Unused capacity of open zones"),
                ("retainzfs_free_bytes", "free_bytes", "Writable capacity"),
                ("retainzfs_reclaimable_bytes", "reclaimable_bytes",
                 "Dead bytes a zone reset or GC gives back to writers"),
                ("retainzfs_host_write_amplification", "host_wa",
                 "Device bytes written per logical byte"),
                ("retainzfs_reserved_overhead_zones", "reserved_overhead_zones",
                 "Invalid plus tail bytes, in zones"),
                ("retainzfs_journal_bytes", "journal_bytes", "Metadata bytes written")):
            yield GaugeMetricFamily(name, doc, value=float(st[key]))
        for name, key, doc in (
                ("retainzfs_zone_resets_total", "zone_resets", "Zone resets since mount"),
                ("retainzfs_gc_copied_bytes_total", "gc_copied_bytes", "Bytes copied by GC"),
                ("retainzfs_enospc_total", "enospc", "Writes refused for lack of space"),
                ("retainzfs_gc_aborted_total", "gc_aborted",
                 "GC passes that left their victim: no room for a copy, a bad checksum or "
                 "a failed read"),
                ("retainzfs_checksum_errors_total", "checksum_errors",
                 "Data reads refused: checksum mismatch"),
                ("retainzfs_read_errors_total", "read_errors",
                 "Data reads the device (or the image's host) failed"),
                ("retainzfs_unstaged_write_bytes_total", "unstaged_write_bytes",
                 "Bytes written to the device straight from the write requests' buffers")):
            c = CounterMetricFamily(name.removesuffix("_total"), doc)
            c.add_metric([], float(st[key]))
            yield c
        for name, key, doc in (
                ("retainzfs_data_write_seconds", "data_write_seconds",
                 "Seconds the write loop held io_lock to place and reserve data"),
                ("retainzfs_device_write_seconds", "device_write_seconds",
                 "Seconds in data device writes, summed over the threads writing")):
            c = CounterMetricFamily(name, doc)
            c.add_metric([], float(st[key]))
            yield c
        yield GaugeMetricFamily("retainzfs_capacity_stop", "1 after an ENOSPC until space is "
                                "freed", value=1.0 if st["capacity_stop"] else 0.0)
        yield GaugeMetricFamily("retainzfs_metadata_full", "1 while new names are refused: "
                                "the metadata zones hold no more",
                                value=1.0 if st["metadata_full"] else 0.0)
        yield GaugeMetricFamily("retainzfs_device_error", "1 after the device failed a flush "
                                "or a metadata write: changes fail with EIO until a remount",
                                value=1.0 if st.get("device_error") else 0.0)
        yield GaugeMetricFamily("retainzfs_buffered_bytes", "Bytes written to open files and "
                                "not yet on the device (bounded by the dirty_bytes option)",
                                value=float(st["buffered_bytes"]))
        d = st.get("daemon") or {}
        if d:
            yield GaugeMetricFamily("retainzfs_daemon_peak_resident_bytes",
                                    "Peak resident memory of the daemon (VmHWM)",
                                    value=float(d["peak_rss_bytes"]))
            yield GaugeMetricFamily("retainzfs_io_buffer_pool_bytes",
                                    "Freed aligned I/O buffers kept for reuse",
                                    value=float(d["io_buffer_pool_bytes"]))
            yield GaugeMetricFamily("retainzfs_io_buffer_live_bytes",
                                    "Aligned I/O buffers in use (write buffers' arenas, "
                                    "replies, readahead windows)",
                                    value=float(d["io_buffer_live_bytes"]))
            yield GaugeMetricFamily("retainzfs_io_buffer_peak_live_bytes",
                                    "The most aligned I/O buffers in use at once",
                                    value=float(d["io_buffer_peak_live_bytes"]))
        h = self.store.report.commit_hist
        yield HistogramMetricFamily("retainzfs_commit_seconds", "close/fsync commit latency",
                                    buckets=h.cumulative(), sum_value=h.sum)


def serve_metrics(store, listen: str):
    """Start the HTTP endpoint in a daemon thread; returns the server (or raises OSError)."""
    from prometheus_client import ProcessCollector, start_http_server
    from prometheus_client.core import CollectorRegistry
    host, port = parse_listen(listen)
    reg = CollectorRegistry(auto_describe=False)
    reg.register(StoreCollector(store))
    ProcessCollector(registry=reg)        # process_resident_memory_bytes, _cpu_seconds_total...
    server, _thread = start_http_server(port, addr=host, registry=reg)
    log.info("metrics on http://%s:%d/metrics", host, port)
    return server
