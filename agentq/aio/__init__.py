"""The event loop the I/O tool worker and the stream worker share: one loop per process,
run by a background thread, fed by Celery's threads pool, watched for blocking."""
