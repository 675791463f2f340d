"""Ray actor pools and the plain worker classes they host."""
