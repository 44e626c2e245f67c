//! The fixed texts the checks send: the same on every run, so two runs against two servers ask
//! the same questions.

/// A passage of about 200 words: the `copy` check's text, and the `drafts` check's long
/// document. Plain ASCII prose, so any tokenizer round-trips it.
pub const PASSAGE: &str = "The lighthouse on Gannet Point was built in 1872 from granite \
quarried three miles inland and hauled to the cliff on sledges pulled by oxen. Its first keeper, \
a former ship's carpenter named Elias Marsh, kept a logbook in which he recorded the weather \
twice a day, the ships that passed, and the birds that struck the lantern glass during the \
autumn migration. The lamp burned colza oil until 1904, when it was replaced by a paraffin \
vapour burner that gave a brighter and steadier flame. In 1931 the station was connected to the \
mainland electricity supply, and the keepers' cottages were fitted with running water for the \
first time. The light was automated in 1987, and the last resident keeper, Margaret Doyle, left \
the point in the spring of that year after nineteen years of service. Today the tower is \
maintained by a volunteer society that opens it to visitors on summer weekends. From the gallery \
at the top, on a clear day, it is possible to see the coast of the neighbouring island, some \
forty kilometres to the north, and the wrecks of two fishing boats that ran aground on the reef \
below during the great storm of 1953.";

pub const ARITHMETIC_PROMPT: &str = "What is 17 multiplied by 23? Work it out step by step.";
pub const CODE_PROMPT: &str =
    "Write a Python function that returns the n-th Fibonacci number, with a docstring.";
pub const STORY_PROMPT: &str = "Tell a short story about a lighthouse keeper who befriends a fox.";

/// `drafts`' greedy prompts: arithmetic, code, a story and a long document, as (label, prompt).
pub fn draft_prompts() -> Vec<(&'static str, String)> {
    vec![
        ("arithmetic", ARITHMETIC_PROMPT.into()),
        ("code", CODE_PROMPT.into()),
        ("story", STORY_PROMPT.into()),
        (
            "long document",
            format!("{PASSAGE}\n\nSummarize the passage above in three sentences."),
        ),
    ]
}

/// `drafts`' sampled prompt, sent with [`SAMPLED_TEMPERATURE`] and [`SEED`].
pub const SAMPLED_PROMPT: &str = "Describe a walk through a forest in autumn.";
pub const SAMPLED_TEMPERATURE: f64 = 0.8;
pub const SEED: u64 = 1234;

/// The instruction of the `copy` check.
pub fn copy_prompt() -> String {
    format!(
        "Repeat the following passage exactly, word for word, and write nothing else.\n\n{PASSAGE}"
    )
}

/// Subjects of `concurrent`'s distinct requests.
pub const TOPICS: &[&str] = &[
    "the moon",
    "bread baking",
    "a river delta",
    "chess openings",
    "honey bees",
    "glass blowing",
    "the printing press",
    "winter storms",
    "coral reefs",
    "steam engines",
    "origami",
    "volcanoes",
];

/// The user's messages of the `multiturn` chat.
pub const MULTITURN: &[&str] = &[
    "My name is Ada and I keep bees. Which flowers should I plant for them?",
    "Which of those bloom earliest in spring?",
    "Summarize our conversation in one sentence, using my name.",
];

/// Questions the `soak` chats cycle through.
pub const SOAK_QUESTIONS: &[&str] = &[
    "Name a city and one thing it is known for.",
    "Why is that?",
    "Give one more example.",
    "Say it again in fewer words.",
    "What would a child ask about this?",
    "Answer that question.",
    "Continue the list.",
];

/// The prompt of the long stream that decodes beside the `soak` chats.
pub const LONG_STREAM_PROMPT: &str = "Once upon a time, in a valley between two mountains,";

/// `max-tokens`' prompt: one that invites a long answer, so a reply runs to its limit.
pub const LONG_ANSWER_PROMPT: &str = "Write a long essay about the history of clocks.";
