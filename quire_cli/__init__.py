"""The composition root, above both applications: the ``quire`` command (``main``), the local
stack (``stack``) and every benchmark (``bench``). Imports ``router`` and ``engine_worker``;
neither of them, nor the shared contract ``quire``, imports this package."""
