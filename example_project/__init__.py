"""An example shop whose orders are charged, reserved and invoiced once, however often the
tasks arrive (``shop.py``), its plain-Celery twin (``plain_shop.py``) and the chaos demo."""
