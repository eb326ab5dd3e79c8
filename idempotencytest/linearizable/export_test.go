package linearizable

// ByKey is byKey, for the one-commit model of the external tests.
var ByKey = byKey
