"""Tools for the tests, bench/ and `make probe`: synthetic members, recipes and
checkpoints, and the coordinates of the local services.  Not installed with the
package; imported from a checkout (the repository root on sys.path)."""
