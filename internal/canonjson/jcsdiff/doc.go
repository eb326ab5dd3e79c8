// Package jcsdiff holds the differential tests of internal/canonjson
// against github.com/gowebpki/jcs, in a module of its own so that jcs is no
// requirement of the library's module. It has no code.
package jcsdiff
