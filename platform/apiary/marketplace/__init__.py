"""The marketplace: job templates (:mod:`templates`), and the model registry's pieces beside them."""
