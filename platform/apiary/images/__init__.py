"""Images for the Docker runtime and the image catalogue.

dockerd and a private registry on loopback (:mod:`.daemons`); the local base image and the
examples' and Apiary's own images, labelled (:mod:`.build`, :mod:`.labels`); the public-name ->
registry-name map (:mod:`.imagemap`); the catalogue of what the registry holds
(:mod:`.catalogue`), who sees and runs which image (:mod:`.namespaces`) and the service behind
``/api/v2/images`` with user builds (:mod:`.service`). The command line is ``apiary image ...``
(:mod:`apiary.cli.image`)."""
