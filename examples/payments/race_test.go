//go:build race

package main

// Under go test -race the server processes are built with -race too, and a
// race they report fails the test that ran them.
func init() { buildFlags = append(buildFlags, "-race") }
