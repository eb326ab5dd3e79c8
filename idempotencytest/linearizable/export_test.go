package linearizable

// ByKey is byKey, for the one-commit model of the external tests.
var ByKey = byKey

// Listing is listing, and Never never, for the one-commit model's history.
var Listing = listing

const Never = never
