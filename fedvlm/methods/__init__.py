"""Methods: ``spec`` says what a method is, ``registry`` lists every method and turns a raw run
config into a checked one (``registry.validate``)."""
