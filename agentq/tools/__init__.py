"""Tools: the @tool decorator, their policy, their context, and the Celery task that runs them."""
