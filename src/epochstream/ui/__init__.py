"""What a user sees of a job beyond its summary line: the web dashboard, ``/metrics`` in
Prometheus' text format and the terminal's live status line.

One document (``model.dashboard``) feeds all three: built from the running job's published
status (``deploy.control.JobControl``) or, for a finished job, from the manifests in its
checkpoint folder (``offline``). ``app.Dashboard`` serves the pages, their data and the
metrics from the job's own HTTP server (``deploy.rest``); the charts are drawn by uPlot
(MIT, vendored in ``static/vendor``: no network at run time).
"""
