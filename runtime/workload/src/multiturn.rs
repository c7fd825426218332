//! Multi-turn chats: conversations in which every turn's prompt is the previous turn's
//! prompt, the answer the server gave to it, and the next user message — so each prompt
//! extends the last prompt and its answer, which is what a prefix cache can reuse.
//!
//! The user messages and the answers' lengths are drawn from the seed before the run;
//! the answers' text comes from the server, so a [`Conversation`] builds each turn's
//! prompt as the run goes, from the answers it has been given. Invariant: the prompt of
//! turn k+1 starts with the prompt of turn k followed by its answer, byte for byte.
//!
//! With shared system prompts ([`crate::SharedPrefix`]), every conversation opens with
//! its group's system prompt, drawn from the seed: chats of one group share that prefix
//! as well as their own history, which is what a multi-turn assistant's traffic is.

use crate::{PlannedRequest, SeededRng, Workload, WorkloadError, text_of, words_of};

/// `conversations` chats of `turns` turns each. With a [`Workload`], every user message
/// (the opening one included) has `isl` words and every answer asks for `osl` tokens.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
pub struct MultiTurn {
    pub conversations: u32,
    pub turns: u32,
}

/// One turn as planned: the user's message and the answer length asked for.
#[derive(Clone, Debug, PartialEq)]
pub struct PlannedTurn {
    pub user: String,
    pub user_words: u32,
    pub osl: u32,
}

/// Who said a message of a conversation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Speaker {
    System,
    User,
    Assistant,
}

/// A system prompt opening a conversation, shared with the other chats of its group.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SystemPrompt {
    pub group: u32,
    pub text: String,
    pub words: u32,
}

/// A chat under way: its system prompt, its planned turns and the answers received so far.
#[derive(Clone, Debug, PartialEq)]
pub struct Conversation {
    system: Option<SystemPrompt>,
    turns: Vec<PlannedTurn>,
    answers: Vec<String>,
}

impl Workload {
    /// The conversations of a multi-turn run, drawn from the seed (a stream of their own,
    /// so a single-turn plan of the same seed is unchanged). The load releases
    /// conversations; their turns follow each other. With shared system prompts,
    /// conversation i opens with the prompt of group i mod groups (the same texts as a
    /// single-turn run of the seed's groups), so every group has its share of chats.
    pub fn conversations(&self, shape: MultiTurn) -> Result<Vec<Conversation>, WorkloadError> {
        if shape.conversations == 0 {
            return Err(WorkloadError("a multi-turn run needs at least 1 conversation".into()));
        }
        if shape.turns == 0 {
            return Err(WorkloadError("a multi-turn run needs at least 1 turn per conversation".into()));
        }
        let mut rng = SeededRng::new(self.seed ^ 0x4d55_4c54_4954_5552);
        let conversations = (0..shape.conversations)
            .map(|i| {
                let system = self.shared.map(|shared| {
                    let group = u64::from(i % shared.groups.max(1));
                    SystemPrompt {
                        group: group as u32,
                        text: text_of(&self.system_prompt(group, shared.words)),
                        words: shared.words,
                    }
                });
                let turns = (0..shape.turns)
                    .map(|_| {
                        let user_words = self.isl.sample(&mut rng);
                        let osl = self.osl.sample(&mut rng);
                        PlannedTurn { user: words_of(user_words, &mut rng), user_words, osl }
                    })
                    .collect();
                Conversation::new(turns).with_system(system)
            })
            .collect();
        Ok(conversations)
    }
}

impl Conversation {
    /// A conversation of these turns, none answered yet.
    pub fn new(turns: Vec<PlannedTurn>) -> Self {
        Conversation { system: None, answers: Vec::with_capacity(turns.len()), turns }
    }

    /// This conversation opening with `system`.
    pub fn with_system(mut self, system: Option<SystemPrompt>) -> Self {
        self.system = system;
        self
    }

    /// Its system prompt, if it has one.
    pub fn system(&self) -> Option<&SystemPrompt> {
        self.system.as_ref()
    }

    /// The planned turns: user messages and answer lengths.
    pub fn planned(&self) -> &[PlannedTurn] {
        &self.turns
    }

    /// Turns planned, answered or not.
    pub fn turns(&self) -> usize {
        self.turns.len()
    }

    /// Turns answered so far.
    pub fn answered(&self) -> usize {
        self.answers.len()
    }

    /// The next turn's request, as one text (the system prompt and a space, if any; the
    /// previous turn's prompt, its answer, a space and the new user message); `None` once
    /// every turn is answered. Its `isl` is the nominal length: system and user words
    /// plus answer tokens asked for, so far.
    pub fn next_request(&self) -> Option<PlannedRequest> {
        let k = self.answers.len();
        let turn = self.turns.get(k)?;
        let mut prompt = String::new();
        if let Some(system) = &self.system {
            prompt.push_str(&system.text);
            prompt.push(' ');
        }
        for (earlier, answer) in self.turns.iter().zip(&self.answers) {
            prompt.push_str(&earlier.user);
            // The answer continues its prompt directly, as a completion does.
            prompt.push_str(answer);
            prompt.push(' ');
        }
        prompt.push_str(&turn.user);
        let isl = self.system_words() + nominal_prompt_tokens(&self.turns[..=k]);
        Some(PlannedRequest { prompt, isl, osl: turn.osl })
    }

    fn system_words(&self) -> u32 {
        self.system.as_ref().map_or(0, |s| s.words)
    }

    /// The next turn's request as chat messages: the system prompt, if any, then user and
    /// assistant alternating, ending with the new user message; empty once every turn is
    /// answered.
    pub fn messages(&self) -> Vec<(Speaker, &str)> {
        let Some(turn) = self.turns.get(self.answers.len()) else { return Vec::new() };
        let system = self.system.iter().map(|s| (Speaker::System, s.text.as_str()));
        let mut messages: Vec<(Speaker, &str)> = system
            .chain(
                self.turns
                    .iter()
                    .zip(&self.answers)
                    .flat_map(|(t, a)| [(Speaker::User, t.user.as_str()), (Speaker::Assistant, a.as_str())]),
            )
            .collect();
        messages.push((Speaker::User, turn.user.as_str()));
        messages
    }

    /// Records the server's answer to the next turn. An answer given after the last turn
    /// is ignored.
    pub fn answer(&mut self, text: String) {
        if self.answers.len() < self.turns.len() {
            self.answers.push(text);
        }
    }
}

/// Prompt tokens of the last of `turns` (user words and earlier answers' tokens).
fn nominal_prompt_tokens(turns: &[PlannedTurn]) -> u32 {
    let (last, earlier) = match turns.split_last() {
        Some(split) => split,
        None => return 0,
    };
    earlier.iter().map(|t| t.user_words + t.osl).sum::<u32>() + last.user_words
}

/// The share of all prompt tokens of `conversations` that a single chip holding every
/// earlier prompt and answer would have cached (the oracle hit rate): turn k+1 finds turn
/// k's prompt and answer, and only its new user message is new; a system prompt is new
/// only to the first conversation of its group. From the plan: user messages and system
/// prompts count as words (about a token each) and answers as the tokens asked for
/// (`ignore_eos` makes them exactly that long); conversations share nothing else.
pub fn oracle_hit_rate(conversations: &[Conversation]) -> f64 {
    let (mut hits, mut total) = (0u64, 0u64);
    let mut groups_seen = std::collections::BTreeSet::new();
    for conversation in conversations {
        let mut before = 0u64;
        if let Some(system) = &conversation.system
            && !conversation.turns.is_empty()
        {
            let words = u64::from(system.words);
            // Every turn repeats the system prompt; only the group's first sight misses it.
            let turns = conversation.turns.len() as u64;
            total += words * turns;
            hits += words * turns - if groups_seen.insert(system.group) { words } else { 0 };
        }
        for turn in &conversation.turns {
            hits += before;
            total += before + u64::from(turn.user_words);
            before += u64::from(turn.user_words) + u64::from(turn.osl);
        }
    }
    hits as f64 / total.max(1) as f64
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{LengthDist, Load, SharedPrefix};

    fn workload(seed: u64) -> Workload {
        Workload {
            isl: LengthDist::Uniform { lo: 3, hi: 9 },
            osl: LengthDist::Fixed(4),
            load: Load::Closed { concurrency: 2 },
            seed,
            shared: None,
        }
    }

    fn turn(user: &str, osl: u32) -> PlannedTurn {
        PlannedTurn { user: user.into(), user_words: user.split(' ').count() as u32, osl }
    }

    #[test]
    fn every_prompt_extends_the_last_prompt_and_its_answer() {
        let mut plan = workload(7).conversations(MultiTurn { conversations: 3, turns: 4 }).unwrap();
        assert_eq!(plan.len(), 3);
        for (c, conversation) in plan.iter_mut().enumerate() {
            assert_eq!(conversation.turns(), 4);
            let mut previous: Option<(String, String)> = None;
            while let Some(req) = conversation.next_request() {
                if let Some((prompt, answer)) = &previous {
                    let head = format!("{prompt}{answer} ");
                    assert!(req.prompt.starts_with(&head), "conversation {c}: {:?} after {head:?}", req.prompt);
                    assert!(req.prompt.len() > head.len(), "a new user message follows");
                }
                assert_eq!(req.osl, 4);
                let answer = format!(" answer {c}.{}", conversation.answered());
                previous = Some((req.prompt, answer.clone()));
                conversation.answer(answer);
            }
            assert_eq!(conversation.answered(), 4);
            assert!(conversation.messages().is_empty(), "nothing left to send");
        }
    }

    #[test]
    fn a_turn_is_a_textual_and_chat_extension_of_the_last() {
        let mut c = Conversation::new(vec![turn("hello there", 3), turn("and then", 2), turn("bye", 1)]);
        let first = c.next_request().unwrap();
        assert_eq!((first.prompt.as_str(), first.isl, first.osl), ("hello there", 2, 3));
        assert_eq!(c.messages(), vec![(Speaker::User, "hello there")]);
        c.answer(" a b c".into());
        let second = c.next_request().unwrap();
        assert_eq!((second.prompt.as_str(), second.isl, second.osl), ("hello there a b c and then", 7, 2));
        assert_eq!(
            c.messages(),
            vec![(Speaker::User, "hello there"), (Speaker::Assistant, " a b c"), (Speaker::User, "and then")]
        );
        c.answer(" d e".into());
        let third = c.next_request().unwrap();
        assert_eq!((third.prompt.as_str(), third.isl), ("hello there a b c and then d e bye", 10));
        c.answer(" f".into());
        c.answer(" ignored".into());
        assert_eq!((c.next_request(), c.answered()), (None, 3));
    }

    #[test]
    fn conversations_are_reproducible_from_the_seed() {
        let shape = MultiTurn { conversations: 4, turns: 3 };
        let a = workload(11).conversations(shape).unwrap();
        assert_eq!(a, workload(11).conversations(shape).unwrap());
        assert_ne!(a, workload(12).conversations(shape).unwrap());
        let openings: std::collections::BTreeSet<String> =
            a.iter().filter_map(|c| c.next_request()).map(|r| r.prompt).collect();
        assert_eq!(openings.len(), 4, "every conversation opens its own way");
        assert!(
            a.iter()
                .flat_map(|c| &c.turns)
                .all(|t| (3..=9).contains(&t.user_words) && t.user.split(' ').count() == t.user_words as usize)
        );
    }

    #[test]
    fn oracle_hit_rate_by_hand() {
        // Turns of 4, 2 and 2 user words, answers of 3 tokens: prompts of 4, 4+3+2 = 9 and
        // 9+3+2 = 14 tokens, of which 0, 7 and 12 were cached: 19 of 27.
        let one = Conversation::new(vec![turn("a b c d", 3), turn("e f", 3), turn("g h", 3)]);
        assert!((oracle_hit_rate(std::slice::from_ref(&one)) - 19.0 / 27.0).abs() < 1e-12);
        // A second, single-turn conversation adds 5 uncached tokens: 19 of 32.
        let two = [one, Conversation::new(vec![turn("i j k l m", 8)])];
        assert!((oracle_hit_rate(&two) - 19.0 / 32.0).abs() < 1e-12);
        assert_eq!(oracle_hit_rate(&[]), 0.0);
        // The nominal prompt lengths of a planned run are the ones counted.
        let plan = workload(3).conversations(MultiTurn { conversations: 2, turns: 5 }).unwrap();
        let (mut hits, mut total) = (0.0, 0.0);
        for c in &plan {
            let mut c = c.clone();
            let mut before = 0.0;
            while let Some(req) = c.next_request() {
                hits += before;
                total += f64::from(req.isl);
                before = f64::from(req.isl + req.osl);
                c.answer(String::new());
            }
        }
        assert!((oracle_hit_rate(&plan) - hits / total).abs() < 1e-12);
    }

    #[test]
    fn shapes_that_describe_no_chat_are_refused() {
        let w = workload(0);
        for (shape, why) in [
            (MultiTurn { conversations: 0, turns: 3 }, "at least 1 conversation"),
            (MultiTurn { conversations: 2, turns: 0 }, "at least 1 turn"),
        ] {
            let e = w.conversations(shape).unwrap_err().0;
            assert!(e.contains(why), "{shape:?}: {e}");
        }
    }

    #[test]
    fn chats_of_a_group_open_with_its_system_prompt() {
        let shared = Workload { shared: Some(SharedPrefix { groups: 3, words: 20 }), ..workload(5) };
        let mut plan = shared.conversations(MultiTurn { conversations: 12, turns: 3 }).unwrap();
        let mut by_group = std::collections::BTreeMap::<u32, String>::new();
        for c in &mut plan {
            let system = c.system().unwrap().clone();
            assert_eq!(system.text.split(' ').count(), 20);
            // One text per group, the same as a single-turn request of that group opens with.
            let text = by_group.entry(system.group).or_insert_with(|| system.text.clone());
            assert_eq!(*text, system.text);
            while let Some(req) = c.next_request() {
                assert!(req.prompt.starts_with(&format!("{} ", system.text)));
                assert_eq!(c.messages()[0], (Speaker::System, system.text.as_str()));
                assert_eq!(c.messages().len(), 2 * c.answered() + 2);
                c.answer(" ok".into());
            }
        }
        assert_eq!(by_group.len(), 3, "12 chats draw every one of 3 groups");
        let single = shared.measured(40);
        assert!(single.iter().any(|r| r.prompt.starts_with(&by_group[&0])), "the groups' texts are the seed's");
        assert_eq!(plan[0].system().map(|s| s.words), Some(20));
        let unshared = workload(5).conversations(MultiTurn { conversations: 2, turns: 2 }).unwrap();
        assert!(unshared.iter().all(|c| c.system().is_none()));
    }

    #[test]
    fn a_system_prompt_is_missed_once_per_group() {
        let system = |group| Some(SystemPrompt { group, text: "s t u v w x y z a b".into(), words: 10 });
        // Turns of 4 and 2 words, answers of 3: prompts of 10+4 and 10+4+3+2 (33 tokens),
        // cached 0 and 10+7 the first time the group is seen, 10 and 17 after.
        let chat = |group| Conversation::new(vec![turn("a b c d", 3), turn("e f", 3)]).with_system(system(group));
        assert!((oracle_hit_rate(&[chat(0)]) - 17.0 / 33.0).abs() < 1e-12);
        assert!((oracle_hit_rate(&[chat(0), chat(0)]) - 44.0 / 66.0).abs() < 1e-12);
        assert!((oracle_hit_rate(&[chat(0), chat(1)]) - 34.0 / 66.0).abs() < 1e-12);
        let first = chat(0).next_request().unwrap();
        assert_eq!((first.prompt.as_str(), first.isl), ("s t u v w x y z a b a b c d", 14));
    }
}
