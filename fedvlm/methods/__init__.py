"""Methods: ``spec`` says what a method is, ``registry`` lists every method once, and
``validation`` turns a raw run config into a checked one (``validation.validate``)."""
