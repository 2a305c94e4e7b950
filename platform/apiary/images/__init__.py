"""Images for the Docker runtime: dockerd and a private registry on loopback (:mod:`.daemons`),
the local base image and the examples' images (:mod:`.build`), the public-name -> registry-name map
(:mod:`.imagemap`). The command line is ``apiary image ...`` (:mod:`apiary.cli.image`)."""
