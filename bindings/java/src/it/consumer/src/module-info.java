/** The consumer as a named module: it reads kvrouter by its Automatic-Module-Name. */
module consumer {
  requires io.kvrouter;
}
