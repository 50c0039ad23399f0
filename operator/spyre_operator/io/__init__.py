"""The operator's I/O: the API server (kube.py), Events (events.py), the watch's cache and the resync
(watch.py), the work queue (workqueue.py) and what a reconcile pass gathers (work.py), metrics and health
(metrics.py), leader election (leader.py)."""
